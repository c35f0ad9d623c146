"""The sans-IO core: pure state machines and values. No trio, httpx, hypercorn or torch."""

"""KV transfer transports behind one interface: NIXL, with TCP as the fallback (see nixl.py)."""

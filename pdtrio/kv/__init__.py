"""KV transfer transports behind one interface (TCP now; NIXL beside it)."""

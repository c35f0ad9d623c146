"""The token path, sans-IO: the decode side's flush policy, each stream's buffer, egress spacing."""

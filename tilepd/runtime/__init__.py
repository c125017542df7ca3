"""tilepd.runtime: the decode node (receive buffer, slot, control server, engine, HTTP API; INTERFACES §4)."""

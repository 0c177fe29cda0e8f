"""The run's network: which address each service binds, the WireGuard overlay, and measured links."""

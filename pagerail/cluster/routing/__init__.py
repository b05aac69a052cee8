"""Data-parallel routing: the router and its prefix index, the routed engine client with failover, the replica pool
and its autoscaling."""

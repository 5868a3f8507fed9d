"""Fault tolerance: config, protocol, node monitor, rank client, launcher, simulated faults."""

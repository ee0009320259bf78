"""`dmtd bench autoscale`: a deterministic replay of load traces against the autoscaling policies."""

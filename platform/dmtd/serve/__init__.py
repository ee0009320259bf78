"""Serving: Ray Serve DMTD replicas, the gRPC/HTTP gateway, the app builder and the τ/k controller."""

"""Running tokenmill on distributed serving systems (Ray Serve: ray_serve.py)."""

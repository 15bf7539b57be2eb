"""The gateway in front of replicas: routing, health, retries, circuit breaking, warm-buffer autoscaling.

It knows replicas only over HTTP (`/ready`, `/metrics`, the OpenAI API) and imports nothing from
`tokenmill.engine` or `tokenmill.server`. Entry points: `tokenmill gateway`, `app.run_gateway`.
"""

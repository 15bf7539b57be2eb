"""`tokenmill bench`: a load generator for any OpenAI-compatible endpoint.

It imports nothing from the engine: workloads (archetypes) → arrival schedule → async streaming
client → per-request records → metrics with vLLM's definitions → table, JSON and plots.
"""

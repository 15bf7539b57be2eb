"""`tokenmill eval`: model-agnostic quality tasks against any OpenAI-compatible endpoint or the
in-process engine, and gates that compare a candidate with a reference (docs/evals.md).

Layers: `client` (Backend interface, target specs) → `http_backend` / `engine_backend`;
`tasks/` (plug-ins behind a registry) → `runner` (one model) → `compare` (two models, gates) →
`report` (tables, JSON, PNG). `metrics` and `sandbox` are plain functions under all of them.
"""

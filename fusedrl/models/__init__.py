"""Real pretrained models for fusedrl on an offline machine: import from GGUF (`import_gguf`) and the cached
SmolLM2-135M-Instruct folder the quickstart, examples and tests use (`smollm2`)."""

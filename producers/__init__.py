"""The ways work comes in: the submit CLI, the OpenAI-compatible API, the status CLI."""

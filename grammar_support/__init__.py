"""What the workers' grammar compiler (xgrammar) enforces, as plain data: a leaf both the
engine (LLM.generate) and the job contract (submit, the API) read. It imports nothing of
kvfleet and no torch."""

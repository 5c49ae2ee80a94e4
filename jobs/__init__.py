"""The job contract producers and workers share. No torch, no engine: the submit
CLI and the API import this without loading a model."""

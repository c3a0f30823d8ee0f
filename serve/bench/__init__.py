"""`serve bench`: a load generator for OpenAI-compatible servers, with JSON and plots."""

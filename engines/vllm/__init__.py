"""Speaking to a vLLM server: its HTTP API, one method per endpoint, with classified errors."""

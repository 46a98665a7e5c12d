"""Speaking to a vLLM server over its HTTP API: one method per endpoint, each with a timeout, and errors
classified (refused, timed out, TLS, an HTTP status). What runs inside vLLM is engines/vllm_worker/."""

from engines.vllm.client import (EngineError, EngineHTTPError, EngineRefused, EngineTimeout, EngineTLSError, VLLMClient,
                                 attached_client, outstanding, tls_context)

__all__ = ["EngineError", "EngineHTTPError", "EngineRefused", "EngineTLSError", "EngineTimeout", "VLLMClient",
           "attached_client", "outstanding", "tls_context"]

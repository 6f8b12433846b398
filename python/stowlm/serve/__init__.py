"""`stowlm serve`: an OpenAI-compatible HTTP server over the continuous-batching engine.

protocol: requests checked field by field; events: the engine's events made into OpenAI's
responses and server-sent events; metrics: what the server counts (/metrics); openai: the
OpenAI routes; context: what every route shares; app: the HTTP app and serve(). Nothing is
imported here, so LLM.create_* (stowlm.compat) take protocol and events without the HTTP stack."""

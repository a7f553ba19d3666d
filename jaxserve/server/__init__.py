"""The OpenAI-compatible HTTP server: `create_app(ServerState(ServerOptions(...)))`."""

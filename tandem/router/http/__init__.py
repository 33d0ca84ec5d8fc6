"""The router's OpenAI-compatible HTTP API (server.py: routes and life cycle;
protocol.py: OpenAI's shapes onto tandem.v1)."""

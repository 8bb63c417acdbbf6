"""The OpenAI-compatible HTTP front: its own process, an asyncio RPC client of the scheduler."""

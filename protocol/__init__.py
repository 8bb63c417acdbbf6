"""Wire types and ZeroMQ transport shared by every process. Imports no torch."""

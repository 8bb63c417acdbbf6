"""`spmdrun`: torchrun-style launcher that starts, supervises and stops the engine's processes."""

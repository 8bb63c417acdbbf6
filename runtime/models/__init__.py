"""Model families the workers can run."""

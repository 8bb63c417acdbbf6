"""Building blocks of the model code the workers run."""

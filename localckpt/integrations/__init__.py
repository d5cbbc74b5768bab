"""Drop-ins for training frameworks (each imports its framework on import)."""

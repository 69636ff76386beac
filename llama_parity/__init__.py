"""llama-parity command-line helpers (fetching the real demo model, the CLI)."""

"""Private helpers of every layer (leaves: they import nothing from ``lightning_mm``), grouped by concern."""

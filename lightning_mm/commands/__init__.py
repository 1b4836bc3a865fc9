"""Sub-commands of ``lightning-mm`` other than LightningCLI's (see ``lightning_mm.cli.COMMANDS``)."""

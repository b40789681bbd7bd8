// Placeholder so the build configures; the real file is written by its owner.

"""Model families and the shared language backbones and vision towers they are built from."""

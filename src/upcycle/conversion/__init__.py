"""Dense checkpoint -> upcycled model: calibration activations, the conversion, the function-preservation check,
the upcycle folder format, loading any kind of folder, and export to stock transformers MoE classes."""

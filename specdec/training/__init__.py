"""Training: self-distilled data, draft distillation, Medusa heads."""

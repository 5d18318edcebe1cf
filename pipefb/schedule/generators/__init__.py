"""Schedule generators, one module per kind; `pipefb.schedule.kinds` registers them."""

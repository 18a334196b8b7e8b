"""The image's own services and facts: its record, constraints, pip wrapper, Lab server, fabric, doctor's
probes and checks, the shipped example notebooks."""

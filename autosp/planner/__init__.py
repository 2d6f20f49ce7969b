"""Stage 3: candidate meshes, the ILP (OR-Tools CP-SAT), the Plan document, reports."""

"""Model building blocks whose parameters are described to the plan before they exist."""

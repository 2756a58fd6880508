"""The torch-free core: the cost graph, plans, the simulator, options and errors."""

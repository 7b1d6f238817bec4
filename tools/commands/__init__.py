"""The `inferbus` command line: the top of the package graph, above the capacity tools and the services."""

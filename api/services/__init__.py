"""What the routers delegate to: validation and persistence logic of each resource."""

"""sdfast's HTTP image-generation service: ``server.app.create_app`` / ``server.app.serve`` (see ``server.app``)."""

"""gRPC servicers (volunteer ``Swarm`` and operator ``Admin``) and the server that hosts them."""

"""The generation APIs the sidecar admits, one module each, behind one protocol
(:class:`~kvgate_agent.sidecar.reading.apis.base.Api`); the route table that maps each path to its
API
is :data:`kvgate_agent.sidecar.reading.endpoints.GENERATION_PATHS`. Deliberately empty: importing
one API imports no other."""

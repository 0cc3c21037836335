"""HTTP plumbing shared by dsec's three HTTP servers, the node API (``server``), the E2B-compatible API
(``e2b``) and the cluster gateway (``cluster``): who is calling (``auth``), the audit log's middleware
(``audit``), work cancelled when its caller goes away (``disconnect``), body limits (``limits``),
Idempotency-Keys (``idempotency``), the one mapping of dsec errors to HTTP answers (``errors``) and two
apps behind one server (``listeners``). It knows nothing of any one API's routes.
"""

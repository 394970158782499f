"""Who a request is and which namespace it may use, for the HTTP ingress.

With a tenant table, a request must carry one of its keys ("Authorization: Bearer
<key>"; otherwise 401) and its namespace is the one it names in `kvfabric.namespace`
if the key grants it (otherwise 403, whether or not another tenant has it), or the
key's default. Nothing else the client sends (`user` included) picks a namespace.
Without a table every caller is one tenant, `OPEN`, free to use any namespace.
The API description (/openapi.json, /docs, /redoc) needs a key like the API does.
"""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse

from .openai_errors import APIError
from .tenants import OPEN, Tenant, TenantTable

__all__ = ["Authorizer", "KeyGuard"]

SWAGGER = "https://cdn.jsdelivr.net/npm/swagger-ui-dist@5"
REDOC = "https://cdn.jsdelivr.net/npm/redoc@2/bundles/redoc.standalone.js"


class Authorizer:
    """The ingress's access rules over a tenant table (or none: one open tenant)."""

    def __init__(self, table: TenantTable | None) -> None:
        if table is not None and not isinstance(table, TenantTable):
            raise TypeError(f"tenants must be a TenantTable or None, got {type(table).__name__}")
        self._table = table

    def tenant(self, request: Request) -> Tenant:
        """The caller's tenant; a 401 without a key of the table."""
        if self._table is None:
            return OPEN
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # Starlette decodes headers as latin-1, so this gives back the bytes sent.
        found = self._table.match(token.strip().encode("latin-1"))
        if scheme.lower() != "bearer" or found is None:
            raise APIError(
                401,
                "invalid or missing API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )
        return found

    @staticmethod
    def namespace(
        tenant: Tenant, requested: str | None, field: str = "kvfabric.namespace"
    ) -> str | None:
        """The namespace a request of `tenant` uses (None: none, `OPEN`'s default); a 403
        for one its key does not grant, naming the request's `field` that asked for it."""
        if requested is None:
            return tenant.default
        if not tenant.grants(requested):
            raise APIError(
                403,
                f"this API key does not grant the namespace {requested!r}",
                type="permission_error",
                code="namespace_forbidden",
                param=field,
            )
        return requested

    def add_docs(self, app: FastAPI) -> None:
        """/openapi.json, /docs and /redoc behind the key. The pages carry the description
        in them: a browser's own fetch of /openapi.json would have no key to send."""

        def spec_js() -> str:
            # In a <script>, "</script>" in a string would end it: escape every "<".
            return json.dumps(app.openapi()).replace("<", "\\u003c")

        @app.get("/openapi.json", include_in_schema=False)
        async def openapi(request: Request) -> JSONResponse:
            self.tenant(request)
            return JSONResponse(app.openapi())

        @app.get("/docs", include_in_schema=False)
        async def swagger(request: Request) -> HTMLResponse:
            self.tenant(request)
            return HTMLResponse(
                f"<!doctype html><html><head><title>{app.title}</title>"
                f'<link rel="stylesheet" href="{SWAGGER}/swagger-ui.css"></head><body><div '
                'id="ui"></div>'
                f'<script src="{SWAGGER}/swagger-ui-bundle.js"></script>'
                f'<script>SwaggerUIBundle({{spec: {spec_js()}, dom_id: "#ui"}})</script>'
                "</body></html>"
            )

        @app.get("/redoc", include_in_schema=False)
        async def redoc(request: Request) -> HTMLResponse:
            self.tenant(request)
            return HTMLResponse(
                f"<!doctype html><html><head><title>{app.title}</title></head><body><div "
                'id="doc"></div>'
                f'<script src="{REDOC}"></script>'
                f'<script>Redoc.init({spec_js()}, {{}}, document.getElementById("doc"))</script>'
                f"</body></html>"
            )


ASGIApp = Callable[
    [dict, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]
]


class KeyGuard:
    """An ASGI app in front of another: every HTTP request needs a key of the table
    (401 otherwise), whatever its route, the API description included. What a key may
    do beyond that (its namespaces) is the routes' own rule."""

    def __init__(self, app: ASGIApp, auth: Authorizer) -> None:
        self.app = app
        self.auth = auth

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            try:
                self.auth.tenant(Request(scope))
            except APIError as e:
                await e.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

// The API reference at /docs: Swagger UI on this API's own schema. A file, not an inline script,
// so the page runs under the same Content-Security-Policy as the dashboard (script-src 'self').
/* global SwaggerUIBundle */
SwaggerUIBundle({
  url: "/openapi.json",
  dom_id: "#swagger-ui",
  deepLinking: true,
  // "Try it out" sends requests from this origin with the session cookie when signed in; a
  // write then also needs X-Requested-With, which Swagger UI does not add, so such writes are
  // refused (403): use an API key (Authorize) for them.
  persistAuthorization: false,
});

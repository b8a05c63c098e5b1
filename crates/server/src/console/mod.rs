//! The web console under `/console`, served by `tine serve` and `tine
//! gateway` (off with `console = false`).
//!
//! A single-page app whose every asset is embedded in the binary
//! (`crates/server/console/`, xterm.js vendored with its licence): the
//! browser loads nothing from anywhere but tine. It holds no server-side
//! logic: every action is a call to the same REST and envd routes the SDKs
//! use, with the same checks, signed with the API key the operator types
//! in. The key lives in the tab's `sessionStorage` and travels in the
//! `X-API-KEY` header, never in a cookie, so another site cannot make the
//! browser act with it (no CSRF), and the Content-Security-Policy lets
//! scripts come only from here.

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use http::{header, HeaderValue, StatusCode};

use crate::api::ApiError;

/// Scripts, connections and images only from tine itself; no frames,
/// forms or plugins. Styles also allow inline: xterm.js's renderer writes
/// the terminal's cell styles into `<style>` elements it makes.
pub const CSP: &str = "default-src 'none'; script-src 'self'; connect-src 'self'; \
     img-src 'self' data:; style-src 'self' 'unsafe-inline'; font-src 'self'; \
     base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// Where the console is served.
pub const PREFIX: &str = "/console";

/// One embedded file.
struct Asset {
    name: &'static str,
    content_type: &'static str,
    body: &'static [u8],
}

const JS: &str = "text/javascript; charset=utf-8";
const CSS: &str = "text/css; charset=utf-8";

const ASSETS: &[Asset] = &[
    Asset {
        name: "console.js",
        content_type: JS,
        body: include_bytes!("../../console/console.js"),
    },
    Asset {
        name: "console.css",
        content_type: CSS,
        body: include_bytes!("../../console/console.css"),
    },
    Asset {
        name: "xterm.js",
        content_type: JS,
        body: include_bytes!("../../console/vendor/xterm/xterm.js"),
    },
    Asset {
        name: "xterm.css",
        content_type: CSS,
        body: include_bytes!("../../console/vendor/xterm/xterm.css"),
    },
    Asset {
        name: "addon-fit.js",
        content_type: JS,
        body: include_bytes!("../../console/vendor/xterm/addon-fit.js"),
    },
    Asset {
        name: "LICENSE.xterm",
        content_type: "text/plain; charset=utf-8",
        body: include_bytes!("../../console/vendor/xterm/LICENSE"),
    },
];

const INDEX: &[u8] = include_bytes!("../../console/index.html");

/// Whether `path` is the console's (and so answered by [`respond`]).
pub fn handles(path: &str) -> bool {
    path == PREFIX || path.starts_with("/console/")
}

/// The answer to a GET of `path` under [`PREFIX`]: the page, an asset, or
/// a 404 in the API's error shape.
pub fn respond(method: &http::Method, path: &str) -> Response {
    if method != http::Method::GET && method != http::Method::HEAD {
        let mut resp = ApiError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            format!("{method} is not allowed on {path}"),
        )
        .into_response();
        resp.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
        return resp;
    }
    let rest = path.strip_prefix(PREFIX).unwrap_or(path);
    let found = match rest {
        "" | "/" | "/index.html" => Some(("text/html; charset=utf-8", INDEX)),
        _ => rest
            .strip_prefix("/assets/")
            .and_then(|name| ASSETS.iter().find(|a| a.name == name))
            .map(|a| (a.content_type, a.body)),
    };
    let Some((content_type, body)) = found else {
        return ApiError::not_found(format!("the console has no {path}")).into_response();
    };
    let mut resp = Response::new(Body::from(body));
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    // Assets change with the binary: always asked again (they are small
    // next to what a page then loads from the API).
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_assets_and_misses() {
        let get = http::Method::GET;
        for p in ["/console", "/console/", "/console/index.html"] {
            let r = respond(&get, p);
            assert_eq!(r.status(), StatusCode::OK, "{p}");
            assert!(r.headers()[header::CONTENT_TYPE]
                .to_str()
                .unwrap()
                .starts_with("text/html"));
            assert_eq!(r.headers()[header::CONTENT_SECURITY_POLICY], CSP);
        }
        let r = respond(&get, "/console/assets/xterm.js");
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(r.headers()[header::CONTENT_TYPE], JS);
        for p in [
            "/console/assets/../../etc/passwd",
            "/console/assets/",
            "/console/assets/nope.js",
            "/console/x",
        ] {
            assert_eq!(respond(&get, p).status(), StatusCode::NOT_FOUND, "{p}");
        }
        let r = respond(&http::Method::TRACE, "/console");
        assert_eq!(r.status(), StatusCode::METHOD_NOT_ALLOWED);
        assert_eq!(r.headers()[header::ALLOW], "GET, HEAD");
        assert!(handles("/console") && handles("/console/assets/x"));
        assert!(!handles("/consoles") && !handles("/sandboxes"));
    }

    #[test]
    fn the_page_loads_only_embedded_assets() {
        let page = std::str::from_utf8(INDEX).unwrap();
        for src in page
            .split("src=\"")
            .skip(1)
            .chain(page.split("href=\"").skip(1))
        {
            let url = &src[..src.find('"').unwrap()];
            if url.starts_with("data:") {
                continue;
            }
            let name = url
                .strip_prefix("/console/assets/")
                .unwrap_or_else(|| panic!("{url} is not one of the console's assets"));
            assert!(
                ASSETS.iter().any(|a| a.name == name),
                "{name} is not embedded"
            );
        }
        assert!(
            !page.contains("<script>"),
            "no inline script: the CSP forbids it"
        );
    }
}

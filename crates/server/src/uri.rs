//! URI forms shared by the proxies that send a client's request on (the
//! injecting egress proxy, the registry guard). A leaf: it imports nothing
//! of the crate.

/// `uri` in origin form (its path and query), as a request goes on to the
/// server it was meant for, whatever form the client sent.
pub fn origin_form(uri: &http::Uri) -> http::Uri {
    uri.path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/")
        .parse()
        .unwrap_or_else(|_| http::Uri::from_static("/"))
}

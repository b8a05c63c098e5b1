//! The MCP server the clients see: the tools and resources of every
//! backend (an MCP server run as a stdio child), under their own names as
//! docker's mcp-gateway shows them, each call routed to its backend.

use std::{collections::HashMap, sync::Arc};

use rmcp::{
    model::*,
    service::{Peer, RequestContext, RoleClient, RoleServer, RunningService},
    transport::TokioChildProcess,
    ErrorData as McpError, ServerHandler, ServiceExt,
};

use crate::catalog::Launch;

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("MCP server {name:?}: cannot start {program}: {source}")]
    Spawn {
        name: String,
        program: String,
        source: std::io::Error,
    },
    #[error("MCP server {name:?}: {what} failed: {msg}")]
    Handshake {
        name: String,
        what: &'static str,
        msg: String,
    },
    #[error("tool {tool:?} is served by both {first:?} and {second:?}: refusing to start")]
    Collision {
        tool: String,
        first: String,
        second: String,
    },
}

/// One running MCP server the gateway fronts.
pub struct Backend {
    pub name: String,
    peer: Peer<RoleClient>,
    resources: bool,
    _service: RunningService<RoleClient, ClientConfig>,
}

impl Backend {
    /// Start `launch` as a child, initialize it and learn its capabilities.
    pub async fn start(launch: &Launch) -> Result<Backend, StartError> {
        let mut cmd = tokio::process::Command::new(&launch.program);
        cmd.args(&launch.args).envs(launch.env.iter().cloned());
        let spawn_err = |source| StartError::Spawn {
            name: launch.name.clone(),
            program: launch.program.clone(),
            source,
        };
        let transport = TokioChildProcess::new(cmd).map_err(spawn_err)?;
        Self::connect(&launch.name, transport).await
    }

    /// Initialize a backend over any transport (a child, or a pipe in tests).
    pub async fn connect<T, E, A>(name: &str, transport: T) -> Result<Backend, StartError>
    where
        T: rmcp::transport::IntoTransport<RoleClient, E, A>,
        E: std::error::Error + Send + Sync + 'static,
    {
        let hs = |what, msg: String| StartError::Handshake {
            name: name.into(),
            what,
            msg,
        };
        let info = ClientConfig::new(
            ClientCapabilities::default(),
            Implementation::new("mcp-gateway", env!("CARGO_PKG_VERSION")),
        )
        .with_protocol_version(ProtocolVersion::LATEST_WITH_INITIALIZE);
        let service = info
            .serve(transport)
            .await
            .map_err(|e| hs("initialize", e.to_string()))?;
        let peer = service.peer().clone();
        let resources = peer
            .peer_info()
            .is_some_and(|i| i.capabilities.resources.is_some());
        Ok(Backend {
            name: name.into(),
            peer,
            resources,
            _service: service,
        })
    }
}

#[derive(Clone)]
pub struct Gateway {
    backends: Arc<Vec<Backend>>,
    tools: Arc<Vec<Tool>>,
    /// tool name -> index of its backend
    route: Arc<HashMap<String, usize>>,
}

impl Gateway {
    /// List every backend's tools; a name two backends share is fatal.
    pub async fn new(backends: Vec<Backend>) -> Result<Gateway, StartError> {
        let mut tools = Vec::new();
        let mut route = HashMap::new();
        for (i, b) in backends.iter().enumerate() {
            let listed = b
                .peer
                .list_all_tools()
                .await
                .map_err(|e| StartError::Handshake {
                    name: b.name.clone(),
                    what: "tools/list",
                    msg: e.to_string(),
                })?;
            for t in listed {
                if let Some(j) = route.insert(t.name.to_string(), i) {
                    return Err(StartError::Collision {
                        tool: t.name.to_string(),
                        first: backends[j].name.clone(),
                        second: b.name.clone(),
                    });
                }
                tools.push(t);
            }
        }
        Ok(Gateway {
            backends: Arc::new(backends),
            tools: Arc::new(tools),
            route: Arc::new(route),
        })
    }

    pub fn tool_names(&self) -> Vec<String> {
        self.tools.iter().map(|t| t.name.to_string()).collect()
    }

    fn with_resources(&self) -> impl Iterator<Item = &Backend> {
        self.backends.iter().filter(|b| b.resources)
    }
}

impl ServerHandler for Gateway {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(
            ServerCapabilities::builder()
                .enable_tools()
                .enable_resources()
                .build(),
        )
        .with_server_info(Implementation::new(
            "mcp-gateway",
            env!("CARGO_PKG_VERSION"),
        ))
    }

    async fn list_tools(
        &self,
        _r: Option<PaginatedRequestParams>,
        _c: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, McpError> {
        Ok(ListToolsResult::with_all_items(self.tools.as_ref().clone()))
    }

    async fn call_tool(
        &self,
        req: CallToolRequestParams,
        _c: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        let Some(&i) = self.route.get(req.name.as_ref()) else {
            return Err(McpError::invalid_params(
                format!("unknown tool {:?}", req.name),
                None,
            ));
        };
        let b = &self.backends[i];
        let mut r =
            b.peer.call_tool_once(req).await.map_err(|e| {
                McpError::internal_error(format!("MCP server {:?}: {e}", b.name), None)
            })?;
        // A backend on an older protocol omits resultType; a client on the
        // newest needs it (rmcp strips it again for older clients).
        if let CallToolResponse::Complete(c) = &mut r {
            c.result_type.get_or_insert(ResultType::COMPLETE);
        }
        Ok(r)
    }

    async fn list_resources(
        &self,
        _r: Option<PaginatedRequestParams>,
        _c: RequestContext<RoleServer>,
    ) -> Result<ListResourcesResult, McpError> {
        let mut all = Vec::new();
        for b in self.with_resources() {
            let listed = b.peer.list_all_resources().await.map_err(|e| {
                McpError::internal_error(format!("MCP server {:?}: {e}", b.name), None)
            })?;
            all.extend(listed);
        }
        Ok(ListResourcesResult::with_all_items(all))
    }

    async fn read_resource(
        &self,
        req: ReadResourceRequestParams,
        _c: RequestContext<RoleServer>,
    ) -> Result<ReadResourceResponse, McpError> {
        for b in self.with_resources() {
            if let Ok(mut r) = b.peer.read_resource_once(req.clone()).await {
                if let ReadResourceResponse::Complete(c) = &mut r {
                    c.result_type.get_or_insert(ResultType::COMPLETE);
                }
                return Ok(r);
            }
        }
        Err(McpError::resource_not_found(
            format!("no MCP server has {}", req.uri),
            None,
        ))
    }
}

//! The services every bapo server carries besides its own: gRPC health
//! (each of its services, and the server as a whole, reported serving) and
//! reflection over every bapo proto and the health proto, so probes and
//! grpcurl work the same against each server.

use tonic_health::{
    ServingStatus,
    pb::health_server::{Health, HealthServer},
    server::HealthReporter,
};
use tonic_reflection::server::v1::{ServerReflection, ServerReflectionServer};

use crate::FILE_DESCRIPTOR_SET;

/// A health service reporting `services` (their gRPC names) and `""` (the
/// server) serving; keep the reporter to change that later.
pub async fn health(services: &[&str]) -> (HealthReporter, HealthServer<impl Health>) {
    let (reporter, server) = tonic_health::server::health_reporter();
    for name in services.iter().copied().chain([""]) {
        reporter
            .set_service_status(name, ServingStatus::Serving)
            .await;
    }
    (reporter, server)
}

/// gRPC reflection over the bapo protos and the health proto.
pub fn reflection()
-> Result<ServerReflectionServer<impl ServerReflection>, tonic_reflection::server::Error> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
}

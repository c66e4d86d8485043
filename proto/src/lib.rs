//! Wire types of bapo, generated from `bapo.proto` (package `bapo.v1`) and the
//! buffer's log records (`wal.proto`), plus [`packed`], the encoding of the
//! per-token arrays, and [`transport`], the connection settings and guard
//! every bapo server shares, [`tls`], mutual TLS with per-role
//! authorization for servers and clients, [`deadline`], the caller's
//! gRPC deadline, [`lineage`], the learner's history both sides check, and
//! [`standard`], the health and reflection services every server carries. Services and cores live in the crates that own them.

pub mod deadline;
pub mod lineage;
pub mod packed;
pub mod standard;
pub mod tls;
pub mod transport;

/// Generated code, nested as the protobuf packages are (`bapo.wal.v1`
/// refers to `bapo.v1` by relative path).
pub mod bapo {
    pub mod v1 {
        tonic::include_proto!("bapo.v1");
    }
    pub mod wal {
        pub mod v1 {
            tonic::include_proto!("bapo.wal.v1");
        }
    }
}

/// `bapo.v1`: rollouts, groups, and the actor- and learner-facing services.
pub use bapo::v1;
/// `bapo.wal.v1`: records of the buffer's write-ahead log.
pub use bapo::wal::v1 as wal;

/// Encoded `FileDescriptorSet` of every bapo proto, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("bapo_descriptor");

/// Name of the protocol's package, as health checks and reflection see it.
pub const PACKAGE: &str = "bapo.v1";

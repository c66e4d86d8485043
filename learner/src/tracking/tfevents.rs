//! TensorBoard's event-file format, written without TensorFlow: each
//! record is an `Event` protobuf (`tensorboard/compat/proto/event.proto`,
//! only the fields bapo writes) framed as TFRecord: little-endian `u64`
//! length, masked CRC-32C of those 8 bytes, the bytes, masked CRC-32C of
//! the bytes. No maintained crate does this on prost 0.14 (the
//! candidates pin prost 0.9-0.12 or rust-protobuf 2), so the few
//! messages are declared here; the tests hold the format's own vectors.

use prost::Message;

/// `Event` (event.proto): a wall time, a step, and one of a file
/// version, a summary or a session log.
#[derive(Clone, PartialEq, Message)]
pub struct Event {
    #[prost(double, tag = "1")]
    pub wall_time: f64,
    #[prost(int64, tag = "2")]
    pub step: i64,
    #[prost(oneof = "What", tags = "3, 5, 7")]
    pub what: Option<What>,
    #[prost(message, optional, tag = "10")]
    pub source_metadata: Option<SourceMetadata>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum What {
    /// "brain.Event:2", first in every file.
    #[prost(string, tag = "3")]
    FileVersion(String),
    #[prost(message, tag = "5")]
    Summary(Summary),
    #[prost(message, tag = "7")]
    SessionLog(SessionLog),
}

#[derive(Clone, PartialEq, Message)]
pub struct SourceMetadata {
    #[prost(string, tag = "1")]
    pub writer: String,
}

/// `SessionLog`: a `START` at step `s` makes readers drop what a file
/// before it logged at steps `>= s` (a learner resumed from an older
/// checkpoint).
#[derive(Clone, PartialEq, Message)]
pub struct SessionLog {
    #[prost(int32, tag = "1")]
    pub status: i32,
}

/// `SessionLog.SessionStatus.START`.
pub const SESSION_START: i32 = 1;

#[derive(Clone, PartialEq, Message)]
pub struct Summary {
    #[prost(message, repeated, tag = "1")]
    pub value: Vec<Value>,
}

/// `Summary.Value`: a scalar (`simple_value`) or a tensor with the
/// metadata naming the plugin that shows it.
#[derive(Clone, PartialEq, Message)]
pub struct Value {
    #[prost(string, tag = "1")]
    pub tag: String,
    #[prost(float, optional, tag = "2")]
    pub simple_value: Option<f32>,
    #[prost(message, optional, tag = "8")]
    pub tensor: Option<TensorProto>,
    #[prost(message, optional, tag = "9")]
    pub metadata: Option<SummaryMetadata>,
}

#[derive(Clone, PartialEq, Message)]
pub struct SummaryMetadata {
    #[prost(message, optional, tag = "1")]
    pub plugin_data: Option<PluginData>,
}

#[derive(Clone, PartialEq, Message)]
pub struct PluginData {
    #[prost(string, tag = "1")]
    pub plugin_name: String,
    #[prost(bytes = "vec", tag = "2")]
    pub content: Vec<u8>,
}

/// `TensorProto` with string values only (the text plugin's).
#[derive(Clone, PartialEq, Message)]
pub struct TensorProto {
    #[prost(int32, tag = "1")]
    pub dtype: i32,
    #[prost(message, optional, tag = "2")]
    pub tensor_shape: Option<TensorShape>,
    #[prost(bytes = "vec", repeated, tag = "8")]
    pub string_val: Vec<Vec<u8>>,
}

#[derive(Clone, PartialEq, Message)]
pub struct TensorShape {
    #[prost(message, repeated, tag = "2")]
    pub dim: Vec<Dim>,
}

#[derive(Clone, PartialEq, Message)]
pub struct Dim {
    #[prost(int64, tag = "1")]
    pub size: i64,
}

/// `DataType.DT_STRING`.
const DT_STRING: i32 = 7;

impl Event {
    /// The first record of a file.
    pub fn file_version(wall_time: f64, writer: &str) -> Self {
        Self {
            wall_time,
            step: 0,
            what: Some(What::FileVersion("brain.Event:2".into())),
            source_metadata: Some(SourceMetadata {
                writer: writer.into(),
            }),
        }
    }

    /// Scalars at `step`.
    pub fn scalars(wall_time: f64, step: u64, values: Vec<(String, f32)>) -> Self {
        let value = values
            .into_iter()
            .map(|(tag, v)| Value {
                tag,
                simple_value: Some(v),
                ..Value::default()
            })
            .collect();
        Self::summary(wall_time, step, Summary { value })
    }

    /// A table of Markdown cells for the text plugin: `rows` of equal
    /// length, the first the header.
    pub fn text_table(wall_time: f64, step: u64, tag: &str, rows: &[Vec<String>]) -> Self {
        let cols = rows.first().map_or(0, Vec::len);
        let tensor = TensorProto {
            dtype: DT_STRING,
            tensor_shape: Some(TensorShape {
                dim: vec![
                    Dim {
                        size: rows.len() as i64,
                    },
                    Dim { size: cols as i64 },
                ],
            }),
            string_val: rows
                .iter()
                .flatten()
                .map(|c| c.as_bytes().to_vec())
                .collect(),
        };
        let value = Value {
            tag: tag.into(),
            tensor: Some(tensor),
            // TextPluginData{version: 0} serialises to no bytes.
            metadata: Some(SummaryMetadata {
                plugin_data: Some(PluginData {
                    plugin_name: "text".into(),
                    content: Vec::new(),
                }),
            }),
            ..Value::default()
        };
        Self::summary(wall_time, step, Summary { value: vec![value] })
    }

    /// A restart at `step`: readers forget what earlier files hold from
    /// `step` on.
    pub fn session_start(wall_time: f64, step: u64) -> Self {
        Self {
            wall_time,
            step: step as i64,
            what: Some(What::SessionLog(SessionLog {
                status: SESSION_START,
            })),
            source_metadata: None,
        }
    }

    fn summary(wall_time: f64, step: u64, summary: Summary) -> Self {
        Self {
            wall_time,
            step: step as i64,
            what: Some(What::Summary(summary)),
            source_metadata: None,
        }
    }
}

/// CRC-32C rotated and offset as TFRecord stores it (so that a CRC of
/// data holding CRCs is not trivially related to them).
pub fn masked_crc32c(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
        .rotate_right(15)
        .wrapping_add(0xa282_ead8)
}

/// One TFRecord: length, its masked CRC, the data, its masked CRC.
pub fn frame(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc32c(data).to_le_bytes());
    out
}

/// An event as the bytes a file holds.
pub fn record(event: &Event) -> Vec<u8> {
    frame(&event.encode_to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    /// The CRC-32C check value, RFC 3720's 32 zero bytes, and the masked
    /// values of TensorBoard's own reader tests
    /// (`tensorboard/data/server/masked_crc.rs`, `tf_record.rs`).
    #[test]
    fn crcs_match_the_formats_vectors() {
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(crc32c::crc32c(&[0u8; 32]), 0x8a91_36aa);
        assert_eq!(masked_crc32c(&[0u8; 32]), 0x0fd7_fffa);
        assert_eq!(masked_crc32c(b"\x1a\x11CRC test, one two"), 0x5794_d08a);
        assert_eq!(masked_crc32c(&24u64.to_le_bytes()), 0x224b_7fa3);
    }

    /// Byte for byte what Python's protobuf and TensorBoard's record
    /// writer produce for the same events.
    #[test]
    fn events_encode_as_tensorboard_writes_them() {
        let v = Event::file_version(1.5, "");
        let mut no_writer = v.clone();
        no_writer.source_metadata = None;
        assert_eq!(
            hex(&record(&no_writer)),
            "1800000000000000a37f4b22\
             09000000000000f83f1a0d627261696e2e4576656e743a32\
             2a28646c"
        );
        let s = Event::scalars(1.5, 7, vec![("loss".into(), 0.25)]);
        assert_eq!(
            hex(&record(&s)),
            "1a00000000000000129bd82d\
             09000000000000f83f10072a0d0a0b0a046c6f7373150000803e\
             c9d07b8d"
        );
    }

    #[test]
    fn a_text_table_decodes_to_its_cells() {
        let rows = vec![
            vec!["**a**".to_string(), "**b**".to_string()],
            vec!["1".to_string(), "x | y".to_string()],
        ];
        let e = Event::text_table(2.0, 3, "rollouts", &rows);
        let back = Event::decode(e.encode_to_vec().as_slice()).unwrap();
        let Some(What::Summary(s)) = back.what else {
            panic!("not a summary")
        };
        let t = s.value[0].tensor.as_ref().unwrap();
        let dims: Vec<i64> = t
            .tensor_shape
            .as_ref()
            .unwrap()
            .dim
            .iter()
            .map(|d| d.size)
            .collect();
        assert_eq!(dims, [2, 2]);
        assert_eq!(t.string_val[3], b"x | y");
        assert_eq!(
            s.value[0]
                .metadata
                .as_ref()
                .unwrap()
                .plugin_data
                .as_ref()
                .unwrap()
                .plugin_name,
            "text"
        );
    }
}

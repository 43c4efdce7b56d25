//! The exported descriptor sets decode, describe the versioned packages, keep
//! their comments, and follow the contract rules (enums start at
//! `*_UNSPECIFIED = 0`, every rpc and field is commented).

use prost::Message;
use prost_types::{FileDescriptorProto, FileDescriptorSet, SourceCodeInfo};
use turbine_proto::{gateway, kvindex, kvstore, planner, router, worker};

fn decode(bytes: &[u8]) -> FileDescriptorSet {
    FileDescriptorSet::decode(bytes).expect("descriptor set decodes")
}

fn file<'a>(set: &'a FileDescriptorSet, package: &str) -> &'a FileDescriptorProto {
    set.file.iter().find(|file| file.package() == package).unwrap_or_else(|| panic!("package {package} missing"))
}

/// The leading comment attached to the element at `path`, if any.
fn comment(info: &SourceCodeInfo, path: &[i32]) -> Option<String> {
    info.location.iter().find(|location| location.path == path).and_then(|location| location.leading_comments.clone()).filter(|text| !text.trim().is_empty())
}

// Field numbers inside FileDescriptorProto / DescriptorProto / ServiceDescriptorProto.
const FILE_MESSAGE_TYPE: i32 = 4;
const FILE_ENUM_TYPE: i32 = 5;
const FILE_SERVICE: i32 = 6;
const MESSAGE_FIELD: i32 = 2;
const SERVICE_METHOD: i32 = 2;
const ENUM_VALUE: i32 = 2;

fn check_contract_rules(set: &FileDescriptorSet, package: &str, expected_services: &[&str]) {
    let file = file(set, package);
    let info = file.source_code_info.as_ref().expect("source info kept");
    let services: Vec<&str> = file.service.iter().map(|service| service.name()).collect();
    assert_eq!(services, expected_services, "{package} services");

    for (service_index, service) in file.service.iter().enumerate() {
        let service_path = [FILE_SERVICE, service_index as i32];
        assert!(comment(info, &service_path).is_some(), "service {} has no comment", service.name());
        for (method_index, method) in service.method.iter().enumerate() {
            let path = [FILE_SERVICE, service_index as i32, SERVICE_METHOD, method_index as i32];
            assert!(comment(info, &path).is_some(), "rpc {}.{} has no comment", service.name(), method.name());
        }
    }
    for (message_index, message) in file.message_type.iter().enumerate() {
        let message_path = [FILE_MESSAGE_TYPE, message_index as i32];
        assert!(comment(info, &message_path).is_some(), "message {} has no comment", message.name());
        for (field_index, field) in message.field.iter().enumerate() {
            let path = [FILE_MESSAGE_TYPE, message_index as i32, MESSAGE_FIELD, field_index as i32];
            assert!(comment(info, &path).is_some(), "field {}.{} has no comment", message.name(), field.name());
        }
    }
    for (enum_index, enumeration) in file.enum_type.iter().enumerate() {
        let first = &enumeration.value[0];
        assert_eq!(first.number(), 0, "enum {} must start at 0", enumeration.name());
        assert!(first.name().ends_with("_UNSPECIFIED"), "enum {} must start with *_UNSPECIFIED", enumeration.name());
        for (value_index, value) in enumeration.value.iter().enumerate() {
            let path = [FILE_ENUM_TYPE, enum_index as i32, ENUM_VALUE, value_index as i32];
            assert!(comment(info, &path).is_some(), "enum value {} has no comment", value.name());
        }
    }
}

#[test]
fn gateway_descriptor_set_follows_the_contract_rules() {
    let set = decode(gateway::v1::FILE_DESCRIPTOR_SET);
    check_contract_rules(&set, "turbine.gateway.v1", &["Inference"]);
}

#[test]
fn kvindex_descriptor_set_follows_the_contract_rules() {
    let set = decode(kvindex::v1::FILE_DESCRIPTOR_SET);
    check_contract_rules(&set, "turbine.kvindex.v1", &["KvIndex"]);
}

#[test]
fn kvstore_descriptor_set_follows_the_contract_rules() {
    let set = decode(kvstore::v1::FILE_DESCRIPTOR_SET);
    check_contract_rules(&set, "turbine.kvstore.v1", &["KvStore"]);
}

#[test]
fn planner_descriptor_set_follows_the_contract_rules() {
    let set = decode(planner::v1::FILE_DESCRIPTOR_SET);
    check_contract_rules(&set, "turbine.planner.v1", &["Planner"]);
}

#[test]
fn router_descriptor_set_follows_the_contract_rules() {
    let set = decode(router::v1::FILE_DESCRIPTOR_SET);
    check_contract_rules(&set, "turbine.router.v1", &["Router"]);
}

#[test]
fn worker_descriptor_set_follows_the_contract_rules() {
    let set = decode(worker::v1::FILE_DESCRIPTOR_SET);
    check_contract_rules(&set, "turbine.worker.v1", &["Worker", "KvTransfer"]);
}

#[test]
fn file_paths_match_package_and_version() {
    for (bytes, package) in [
        (gateway::v1::FILE_DESCRIPTOR_SET, "turbine.gateway.v1"),
        (kvindex::v1::FILE_DESCRIPTOR_SET, "turbine.kvindex.v1"),
        (router::v1::FILE_DESCRIPTOR_SET, "turbine.router.v1"),
        (worker::v1::FILE_DESCRIPTOR_SET, "turbine.worker.v1"),
        (kvstore::v1::FILE_DESCRIPTOR_SET, "turbine.kvstore.v1"),
        (planner::v1::FILE_DESCRIPTOR_SET, "turbine.planner.v1"),
    ] {
        let set = decode(bytes);
        let file = file(&set, package);
        let directory = package.replace('.', "/");
        assert!(file.name().starts_with(&format!("{directory}/")), "{} is not under {directory}/", file.name());
    }
}
